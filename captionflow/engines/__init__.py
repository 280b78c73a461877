"""What starts and feeds engines: the Ray session, presets, engine settings, the Ray Data LLM processor of one LLM
pass, the request format, staging a checkpoint, the engines' log lines. Below the warm engine service (``service/``)
and the stages (``stages/``): it imports neither."""
