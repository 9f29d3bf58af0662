"""A model repository of one echo model (tritonserver tests that need no engine)."""
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]

ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""
ECHO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils
import pagedbackend.config  # the venv's packages are importable from the stub


class TritonPythonModel:
    def initialize(self, args):
        {init}

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            out = np.array([b"echo:" + text], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)]))
        return responses
"""


def write_echo_repository(root: pathlib.Path, init: str = "pass") -> pathlib.Path:
    model = root / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(ECHO_CONFIG)
    (model / "1" / "model.py").write_text(ECHO_MODEL.replace("{init}", init))
    return root
