"""The model repository that tritonserver loads: found, read, copied with
other parameters, and its models' weights prepared before the server starts
(a slow first preparation then happens here, not inside a model load)."""
import os
import pathlib
import shutil
from typing import Any, Dict, Mapping, Optional

from pagedbackend.config import ENV_PREFIX
from pagedbackend.serving.constants import SERVED_MODEL

MODEL_REPOSITORY_ENV = "PAGEDBACKEND_MODEL_REPOSITORY"
# The folder holding the pagedbackend package. When the package runs from its
# source tree (or is installed editable) that is the checkout, with
# model_repository/ beside it; an installed package has none there.
PACKAGE_PARENT = pathlib.Path(__file__).resolve().parents[2]


def default_model_repository(environ: Mapping[str, str] = os.environ) -> pathlib.Path:
    """``$PAGEDBACKEND_MODEL_REPOSITORY``, else the checkout's ``model_repository/``."""
    given = environ.get(MODEL_REPOSITORY_ENV)
    if given:
        return pathlib.Path(given)
    checkout = PACKAGE_PARENT / "model_repository"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"no model repository given and no checkout's model_repository/ at {checkout}: "
                            f"pass --model-repository or set {MODEL_REPOSITORY_ENV}")


def read_model_config(config_text: str):
    """A ``config.pbtxt`` as Triton's ``ModelConfig`` protobuf message."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    return text_format.Parse(config_text, model_config_pb2.ModelConfig())


def read_parameters(config_text: str) -> Dict[str, str]:
    """The ``parameters`` (string values) of a config.pbtxt."""
    return {key: value.string_value for key, value in read_model_config(config_text).parameters.items()}


def make_model_repository(dest, settings: Mapping[str, Any] = (), source=None,
                          model_name: str = SERVED_MODEL, name: Optional[str] = None) -> pathlib.Path:
    """Copy ``source/model_name`` (``source``: ``default_model_repository()`` if
    not given) into ``dest`` (as ``name``, default the same) with some
    parameters replaced or added."""
    from google.protobuf import text_format
    source = default_model_repository() if source is None else pathlib.Path(source)
    dest = pathlib.Path(dest)
    target = dest / (name or model_name)
    shutil.copytree(source / model_name, target, ignore=shutil.ignore_patterns("__pycache__"))
    config_file = target / "config.pbtxt"
    config = read_model_config(config_file.read_text())
    for key, value in dict(settings).items():
        value = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        config.parameters[key].string_value = value
    config_file.write_text(text_format.MessageToString(config))
    return dest


def parse_model_args(items) -> Dict[str, str]:
    """``--model`` values: NAME=FOLDER pairs in order (several served models,
    one Triton model each), or one plain FOLDER (returned under the name "")."""
    models: Dict[str, str] = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep:
            if len(items) > 1:
                raise ValueError(f"{item!r}: with several models each is NAME=FOLDER")
            return {"": item}
        if not name or not folder or name in models or "/" in name or name.startswith("."):
            raise ValueError(f"{item!r}: expected NAME=FOLDER, a plain name used once")
        models[name] = folder
    return models


def served_repository(dest, models: Mapping[str, str], settings: Mapping[str, str],
                      per_model: Mapping[str, Mapping[str, str]], source=None) -> pathlib.Path:
    """A repository in ``dest`` with one copy of ``source``'s model per entry
    of ``models`` (name -> model folder or GGUF file), its parameters
    ``settings`` and then that model's own ``per_model`` settings."""
    for name, folder in models.items():
        folder = os.path.abspath(folder) if os.path.exists(folder) else folder
        make_model_repository(dest, {**settings, **per_model.get(name, {}), "model": folder}, source=source,
                              name=name)
    return pathlib.Path(dest)


def repository_models(model_repository) -> list:
    """Names of the repository's model folders (those with a config.pbtxt)."""
    return sorted(path.parent.name for path in pathlib.Path(model_repository).glob("*/config.pbtxt"))


def only_our_models(model_repository) -> bool:
    """Whether every model of the repository is a copy of ours (its config.pbtxt
    complete, each version's model.py the shipped one), so that tritonserver
    need not start a Python stub per model only to ask it for its config."""
    try:
        shipped = (default_model_repository({}) / SERVED_MODEL / "1" / "model.py").read_bytes()
    except OSError:
        return False
    folders = [path for path in pathlib.Path(model_repository).iterdir() if path.is_dir()]
    for folder in folders:
        versions = [path for path in folder.iterdir() if path.is_dir() and path.name.isdigit()]
        if not (folder / "config.pbtxt").is_file() or not versions:
            return False
        for version in versions:
            model = version / "model.py"
            if not model.is_file() or model.read_bytes() != shipped:
                return False
    return bool(folders)


def build_step_packages(model_repository, environ: Mapping[str, str] = os.environ) -> list:
    """Build the compiled step package (``worker/step_package.py``) of every
    repository model whose settings serve one; returns their paths."""
    import torch

    from pagedbackend.config import engine_config
    from pagedbackend.worker import step_build, step_package
    paths = []
    for config_file in sorted(pathlib.Path(model_repository).glob("*/config.pbtxt")):
        config = engine_config(read_parameters(config_file.read_text()), environ)
        if step_package.wanted(config):
            paths.append(step_build.build(config, torch.get_num_threads()))
    return paths


def prepare_models(model_repository, environ: Mapping[str, str] = os.environ,
                   failures: Optional[list] = None) -> list:
    """Resolve (and for "default", build once) each repository model's weights folder.
    A model that cannot be prepared is reported in ``failures`` as (name, error)
    and skipped, as tritonserver skips a model it cannot load; without
    ``failures`` the first error is raised."""
    try:
        from pagedbackend.models.default_model import resolve_model_path
    except ImportError:
        return []
    override = environ.get(ENV_PREFIX + "MODEL")
    paths = []
    for config_file in sorted(pathlib.Path(model_repository).glob("*/config.pbtxt")):
        try:
            params = read_parameters(config_file.read_text())
            if "model" in params or override:
                paths.append(resolve_model_path(override or params["model"]))
        except Exception as exc:
            if failures is None:
                raise
            failures.append((config_file.parent.name, exc))
    return paths
