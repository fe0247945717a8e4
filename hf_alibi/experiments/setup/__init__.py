"""A run's setup, before anything trains: its arguments (`arguments`, parsed by `parsing` from YAML configs and the
command line), the token budget (`token_budget`), the launch checks and output folder (`launch`), the baseline
models (`baselines`) and the evaluation arms (`eval_arms`)."""
