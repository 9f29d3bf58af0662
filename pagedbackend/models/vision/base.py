"""What the engine asks of a family's vision encoder (tower + projector)."""
from typing import Dict, Iterable, List, Mapping, Tuple

import torch
from torch import nn


class VisionEncoder(nn.Module):
    """A family's vision tower and projector.

    ``split_images``: the processor's output for one prompt (``pixel_values``
    and what goes with it, for all of the prompt's images) as one dict per
    image, in prompt order; ``num_embeds``: how many embedding rows one image
    gives (the placeholder tokens the processor put in the prompt for it);
    ``forward``: one image's dict to its rows ``[num_embeds, text hidden]`` in
    the text model's dtype; ``load_weights``: the checkpoint's tensors of the
    tower and projector, named as in the checkpoint without the family's
    prefix (``vision_tower.``, ``multi_modal_projector.``: the family routes
    them). Runs without grad on the runner's device. ``bidirectional``: one
    image's embedding rows attend to each other both ways inside the causal
    decoder (Gemma 3): each image run is computed in one prefill chunk
    (``core.whole_spans``) and attends as a block (``models.attention``)."""
    bidirectional = False

    def split_images(self, processed: Mapping[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
        raise NotImplementedError

    def num_embeds(self, image: Mapping[str, torch.Tensor]) -> int:
        raise NotImplementedError

    def forward(self, image: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError
