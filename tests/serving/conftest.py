"""Every API test reads standard JSON only: each JSON body and server-sent
event its httpx and openai clients read is parsed again with a parser that
refuses NaN and the infinities (``strict_json``); a test that received one
fails, naming it."""
import pytest

from strict_json import StrictResponses


@pytest.fixture(autouse=True)
def standard_json_only():
    checker = StrictResponses()
    checker.install()
    try:
        yield checker
    finally:
        checker.uninstall()
    assert not checker.problems, "responses that are not standard JSON:\n" + "\n".join(checker.problems)
