"""Token selection: greedy / sampled rows (``sampler``) and beam search."""
from .beam_search import BeamSearchState
from .sampler import Sample, SampleRow, Sampler, sample

__all__ = ["BeamSearchState", "Sample", "SampleRow", "Sampler", "sample"]
