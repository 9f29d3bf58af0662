"""``python -m pagedbackend.serve``: the tritonserver launcher
(``pagedbackend.serving.launcher``; ``--help`` lists its options)."""
import sys

from pagedbackend.serving.launcher import main

if __name__ == "__main__":
    sys.exit(main())
