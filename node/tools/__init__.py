"""Tools on a trained node's model, outside any round: `sapo-export` (the model out, in formats other tools
load) and `sapo-ask` (its answers to a question, or its score on a task mix's held-out set). Nothing of the
node imports them."""
