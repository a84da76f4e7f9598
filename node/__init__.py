"""SAPO swarm node: round loop, tasks, policy, GRPO."""
from node.lazy import import_lazily

__version__ = "0.1.0"

# hivemind imports its averaging stack, and with it scipy.optimize (0.5 s of CPU at each start), which a node
# never uses: a stand-in until first used, registered before any part of the node imports hivemind
import_lazily("scipy.optimize")
