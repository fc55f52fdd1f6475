"""The public surface for plug-ins: what a module outside qie imports to add a kind of thing that configuration
alone then wires in (`_target_`)."""

from qie.evaluation.reward import Reward

__all__ = ["Reward"]
