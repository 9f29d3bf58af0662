"""Qwen2.5-VL against Hugging Face on a tiny random checkpoint saved by
transformers (``loadtest.tiny_vision``): the vision tower (window attention
over several windows, full attention, the 2 x 2 merge) row for row; M-RoPE
positions equal to ``get_rope_index`` for whole prompts and for any chunk of
them; greedy tokens through ``LLM.generate`` equal to ``generate`` with one
image, two images of other sizes, an image and a long text, and a batch
mixing text-only and image prompts."""
import pytest
import torch

from pagedbackend import LLM
from pagedbackend.models.mrope import rope_delta, sequence_positions, step_positions
from pagedbackend.models.vision.qwen2_5_vl import window_order
from pagedbackend.multimodal.processor import items_at_placeholders
from qwen_vl_reference import GREEDY, QwenReference, image, request, tokens_of

LONG = " ".join(f"word{i} and the llama number {i} walks on." for i in range(40))


@pytest.fixture(scope="module")
def ref(tiny_vision):
    return QwenReference(tiny_vision("qwen2_5_vl"))


@pytest.fixture(scope="module")
def llm(ref):
    engine = LLM(model=str(ref.folder), dtype="float32", device="cpu", block_size=8, num_kv_blocks=128,
                 compile=False)
    yield engine
    engine.shutdown()


def items_of(ref, text, seeds):
    """Our image items of a prompt (the engine's processor)."""
    out = ref.inputs(text, seeds)
    ids = out["input_ids"][0].tolist()
    grids = out["image_grid_thw"] if seeds else torch.zeros((0, 3), dtype=torch.long)
    per_image = [{"image_grid_thw": g[None]} for g in grids]
    return out, items_at_placeholders(ids, ref.model.config.image_token_id, per_image,
                                      [int(g.prod()) // 4 for g in grids], ["00" * 32] * len(grids))


@pytest.mark.parametrize("seed", [1, 2, 4])
def test_vision_tower_is_transformers_visual(ref, llm, seed):
    inputs = ref.inputs(ref.chat("x", 1), [seed])
    t, h, w = inputs["image_grid_thw"][0].tolist()
    _, windows = window_order(t, h, w, 2, 2)
    assert len(windows) > 1 and t * h * w > 4   # window attention and the merge are exercised
    with torch.no_grad():
        expected = ref.model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        ours = llm.engine.runner.model.vision(dict(inputs))
    assert ours.shape == expected.shape == (t * h * w // 4, 64)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seeds", [(), (1,), (2, 3), (4, 1)])
def test_mrope_positions_are_transformers_get_rope_index(ref, seeds):
    text = ref.chat("look" + LONG[:60], len(seeds))
    inputs, items = items_of(ref, text, seeds)
    n = inputs["input_ids"].shape[1]
    if seeds:
        expected, delta = ref.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                          inputs["image_grid_thw"])
        expected, delta = expected[:, 0], int(delta)
        assert delta < 0   # images take fewer positions than placeholders: the streams differ from 1-D
    else:
        expected, delta = torch.arange(n).expand(3, -1), 0
    assert torch.equal(sequence_positions(items, 0, n, 2), expected)
    assert rope_delta(items, 2) == delta
    # any chunk, a decode past the prompt: the same positions from where it starts
    for start, end in ((5, 9), (7, n), (n - 3, n), (n, n + 2)):
        chunk = sequence_positions(items, start, end, 2)
        whole = expected[:, start:end] if end <= n else torch.arange(start, end).expand(3, -1) + delta
        assert torch.equal(chunk, whole)


def test_step_positions_of_mixed_entries(ref):
    """A step of a chunk inside an image, a decode past two images and a
    text-only sequence: each entry's rows are its own sequence's positions."""
    from pagedbackend.core.scheduled import SeqEntry
    _, one = items_of(ref, ref.chat("a", 1), (1,))
    inputs, two = items_of(ref, ref.chat("b", 2), (2, 3))
    n = inputs["input_ids"].shape[1]
    entries = [SeqEntry([0] * 6, one[0].offset + 3, [], mm_items=tuple(one)),
               SeqEntry([0], n + 4, [], mm_items=tuple(two)), SeqEntry([0] * 3, 10, [])]
    flat = torch.tensor([*range(one[0].offset + 3, one[0].offset + 9), n + 4, 10, 11, 12])
    expected = torch.cat([sequence_positions(one, one[0].offset + 3, one[0].offset + 9, 2),
                          sequence_positions(two, n + 4, n + 5, 2), torch.arange(10, 13).expand(3, -1)], dim=1)
    assert torch.equal(step_positions(entries, 2, flat), expected)
    assert not torch.equal(expected, flat.expand(3, -1))


def test_greedy_tokens_are_transformers_generate(ref, llm):
    prompts = [(ref.chat("what is this?", 1), (1,)),
               (ref.chat("compare them", 2), (2, 3)),
               (ref.chat("describe it. " + LONG, 1), (4,)),
               (ref.chat("say something about llamas", 0), ())]
    expected = [ref.greedy(text, seeds) for text, seeds in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)
    # alone, and all in one batch beside a text-only prompt
    assert [tokens_of(llm.generate([request(t, s)], GREEDY))[0] for t, s in prompts] == expected
    assert tokens_of(llm.generate([request(t, s) for t, s in prompts], GREEDY)) == expected


def test_the_image_changes_the_tokens(ref):
    """A real check: another picture in the same prompt gives other tokens."""
    text = ref.chat("what is this?", 1)
    assert ref.greedy(text, (1,)) != ref.greedy(text, (5,))
    assert image(5).size == image(1).size


def test_both_checkpoint_layouts_load_alike(ref):
    """transformers 5's names (``model.language_model.``, ``model.visual.``)
    load as the original ones the tiny checkpoint holds (``model.layers.``, ``visual.``)."""
    import json

    from pagedbackend.models import model_args, model_class
    from pagedbackend.worker.loader import read_safetensors
    args = model_args(json.loads((ref.folder / "config.json").read_text()))
    original, renamed = (model_class("qwen2_5_vl")(args, torch.float32) for _ in range(2))

    def new_name(name):
        if name.startswith("visual."):
            return "model." + name
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
    original.load_weights(read_safetensors(ref.folder))
    names = [name for name, _ in read_safetensors(ref.folder)]
    assert any(n.startswith("visual.") for n in names) and any(n.startswith("model.layers.") for n in names)
    renamed.load_weights((new_name(name), t) for name, t in read_safetensors(ref.folder))
    theirs = dict(renamed.named_parameters())
    for name, param in original.named_parameters():
        assert torch.equal(param, theirs[name]), name
