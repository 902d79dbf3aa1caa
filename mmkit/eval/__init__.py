"""Evaluation: `evaluation.py` (datasets, answer matching, resumable results; `mmkit eval`),
`scoring.py` (continuation log-likelihoods), `scenes.py` (the default model's procedural
data), `ray_eval.py` (`mmkit eval --ray`, needs the `ray` extra)."""
