"""``python -m pagedbackend.serving.openai_server``: the OpenAI-compatible API
(``pagedbackend.serving.openai``; ``--help`` lists its options)."""
import sys

from pagedbackend.serving.openai.cli import main

if __name__ == "__main__":
    sys.exit(main())
