"""OpenAI chat message content: a string, or a list of parts, text
(``{"type": "text", "text": ...}``) and images (``{"type": "image_url",
"image_url": {"url": "data:image/png;base64,..."}}``; the url may be bare
base64 too, and ``detail`` is accepted and ignored).

For the chat template, a content of text parts alone becomes one string (as
before images, so that every template reads it); with images it stays a list
in which each image is ``{"type": "image"}``, the form the vision families'
templates turn into their placeholder. The images themselves travel to the
model as they came (the Triton model decodes them, ``serving.images``).
"""
from typing import List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedbackend.errors import InvalidRequestError


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")   # e.g. cache_control, which changes nothing here
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: Optional[str] = None   # OpenAI's resolution hint; the model's processor decides


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: Union[ImageURL, str]   # some clients send the URL itself

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


def template_content(content, index: int) -> Tuple[Union[str, list, None], List[str]]:
    """Message ``index``'s content as its chat template takes it, and the
    image URLs it holds, in order."""
    if not isinstance(content, list):
        return content, []
    parts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        try:
            if kind == "image_url":
                images.append(ImagePart.model_validate(part).url)
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": TextPart.model_validate(part).text})
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            if kind not in ("text", "image_url"):
                message = f"content parts are text and image_url, got {kind!r}"
            else:
                message = f"{kind} part: {where}: {first['msg']}"
            raise InvalidRequestError(f"messages[{index}].content[{j}]: {message}", "messages") from None
    if not images:
        return "\n".join(p["text"] for p in parts), []
    return parts, images
