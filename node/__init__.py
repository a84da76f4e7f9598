"""SAPO swarm node: round loop, tasks, policy, GRPO."""

from node.lazy import import_lazily

__version__ = "0.1.0"

# hivemind imports its averaging stack, and with it scipy.optimize (0.5 s of CPU), which the swarm never uses: a
# stand-in until first used, registered before any part of the node imports hivemind. It spares the processes
# that load no model (the bootstrap peer); loading a model imports it anyway (transformers' detection loss)
import_lazily("scipy.optimize")
