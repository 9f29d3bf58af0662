"""A prefill chunk never ends inside a span computed whole (Gemma 3's images)."""
from pagedbackend.core.whole_spans import chunk_outside_spans, image_runs

SPANS = [(10, 20), (30, 34)]


def test_a_chunk_that_would_end_inside_a_span_stops_before_it():
    assert chunk_outside_spans(0, 15, SPANS, room=15) == 10
    assert chunk_outside_spans(20, 12, SPANS, room=100) == 10   # stops before the second


def test_a_chunk_starting_at_or_inside_a_span_takes_the_rest_of_it_when_the_step_has_room():
    assert chunk_outside_spans(10, 4, SPANS, room=10) == 10
    assert chunk_outside_spans(14, 3, SPANS, room=6) == 6       # a cached prefix ended mid-span
    assert chunk_outside_spans(10, 4, SPANS, room=9) == 0       # waits for a step with room


def test_chunks_ending_outside_spans_are_left_alone():
    assert chunk_outside_spans(0, 10, SPANS, room=10) == 10     # ends where the span starts
    assert chunk_outside_spans(0, 25, SPANS, room=25) == 25
    assert chunk_outside_spans(10, 10, SPANS, room=10) == 10    # the whole span
    assert chunk_outside_spans(0, 40, SPANS, room=40) == 40
    assert chunk_outside_spans(0, 5, [], room=5) == 5


def test_image_runs_are_the_spans_or_the_runs_of_their_embed_masks():
    from pagedbackend.multimodal.inputs import MultiModalItem
    plain = MultiModalItem("image", "a", 30, 4, None, {})
    crops = MultiModalItem("image", "b", 5, 9, (True, True, False, False, True, True, True, False, True), {})
    assert image_runs([plain, crops]) == [(5, 7), (9, 12), (13, 14), (30, 34)]
