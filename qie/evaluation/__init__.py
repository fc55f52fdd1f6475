"""Evaluation: metrics and judges as rewards (`qie.evaluation.reward.Reward`, the protocol RL's rewards share), the
eval stage's scoring of runs (base model and LoRAs) and its reports."""
