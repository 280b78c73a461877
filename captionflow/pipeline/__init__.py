"""What starts or drives a Ray job: the Ray session, presets, engine settings, the stages that run on Ray."""
