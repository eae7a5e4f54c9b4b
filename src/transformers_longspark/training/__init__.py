"""Distilling a LongSpark drafter from its target: the data (`data.py`: regenerated chats, `corpora.py`: packed
text, `prompt_sources.py`: prompt sets, `regenerate.py`: the target's own responses), one training example and its loss
(`distillation.py`), the warm start (`warm_start.py`) and the run (`run.py`: config, optimiser, checkpoints)."""
