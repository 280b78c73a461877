"""captionflow: batch image captioning and VLM checkpoint evaluation on Prefect, Ray Data and vLLM."""

__version__ = "0.1.0"
