"""Images through Triton's ``image`` tensor to a tiny random Qwen2.5-VL
(loadtest/tiny_vision.py) on a real tritonserver: one image, and two of
other sizes, give exactly Hugging Face ``generate``'s tokens (greedy, its
processor, the same images), and ``num_input_tokens`` counts the image pads."""
import pytest

from image_files import b64, encoded
from loadtest.harness.triton import TritonServer
from pagedbackend.serving.repository import make_model_repository
from qwen_vl_reference import NEW_TOKENS, QwenReference, image
from triton_images import MAX_TOKENS, SETTINGS, triton_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ref(tiny_vision):
    return QwenReference(tiny_vision("qwen2_5_vl"))


@pytest.fixture(scope="module")
def triton(tmp_path_factory, ref):
    repo = make_model_repository(tmp_path_factory.mktemp("repo"), {"model": ref.folder, **SETTINGS})
    with TritonServer(repo, ready_timeout_s=240) as running:
        yield running


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seeds", [(1,), (2, 3)], ids=["one-image", "two-images"])
def test_the_triton_image_tensor_gives_hf_generates_tokens(triton, ref, seeds):
    text = ref.chat("What is in the picture?", len(seeds))
    expected = ref.greedy(text, seeds)
    assert len(expected) == NEW_TOKENS == MAX_TOKENS   # no EOS inside: the server's ignore_eos changes nothing

    got, prompt_tokens = triton_tokens(triton, text, [b64(encoded(image(s))) for s in seeds])

    assert got == expected
    assert prompt_tokens == ref.inputs(text, seeds)["input_ids"].shape[1]   # the image pads included
