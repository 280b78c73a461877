"""The run's stages on Ray: preprocess, inference (the caption pass: ``caption_pass.py``), judge, pairwise,
CLIPScore. The top floor of the library's Ray side: they use the engines (``engines/``), the warm engine service
(``service/``) and the run's bookkeeping (``runs/``)."""
