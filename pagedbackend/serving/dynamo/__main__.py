"""``python -m pagedbackend.serving.dynamo --model-path FOLDER --triton-url HOST:PORT ...``"""
from pagedbackend.serving.dynamo.worker import main

if __name__ == "__main__":
    main()
