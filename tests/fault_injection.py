"""Test-only faults inside a served model, for faults no request can cause.

``make_faulty_repository`` copies the real model repository and appends a few
lines to its ``model.py`` that make one engine function raise for sequences
whose prompt is exactly ``poison_ids``; every other request runs the real code.
"""
import pathlib

from pagedbackend.serving.repository import make_model_repository

HOOKS = {
    # One request's detokenisation raises: it must fail alone.
    "detokenise": '''
import pagedbackend.engine.output_processor as _target
_real = _target.decode_new_text
def _faulty(tokenizer, seq, *args, **kwargs):
    if seq.token_ids[:seq.num_prompt_tokens] == _POISON_IDS:
        raise RuntimeError("injected detokenisation fault")
    return _real(tokenizer, seq, *args, **kwargs)
_target.decode_new_text = _faulty
''',
    # The forward pass raises (as a lost device would): the engine is dead.
    "forward": '''
import pagedbackend.worker.model_runner as _target
_real = _target.ModelRunner.execute_model
def _faulty(self, entries):
    if any(e.seq.token_ids[:e.seq.num_prompt_tokens] == _POISON_IDS for e in entries):
        raise RuntimeError("injected device fault")
    return _real(self, entries)
_target.ModelRunner.execute_model = _faulty
''',
}


def make_faulty_repository(dest, settings, fault: str, poison_ids) -> pathlib.Path:
    repo = make_model_repository(dest, settings)
    model_py = repo / "paged_llm" / "1" / "model.py"
    model_py.write_text(model_py.read_text() + "\n\n# ---- test-only fault (tests/fault_injection.py) ----\n"
                        + f"_POISON_IDS = {list(poison_ids)!r}\n" + HOOKS[fault])
    return repo
