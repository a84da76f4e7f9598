"""SAPO swarm node: round loop, tasks, policy, GRPO."""
__version__ = "0.1.0"
