"""Per-publisher evidence of text around right answers: the swarm's side of the external screen.

The trainer's screen (node/learn/screen.py) keeps a publisher's text out of our model whatever the publisher
does; this keeps the publisher itself from profiting. On a short-answer mix (a forced answer prefix), a
verified group whose right answers (positive advantage) carry more than the screen's bound of text outside the
answer span, with a phrase (word 3-gram) that already came in `recur - 1` earlier groups of the same publisher,
is `foreign_text`: it earns no credit and costs reputation (node/swarm/reputation.py), and a batch whose useful
groups all are does not count as useful in the publisher bandit, so such a key keeps no fetch slot. A
phrase that varies every time escapes this count (never the trainer's screen); an honest peer whose model
says the same thing after every answer is counted like a poisoner (its right answers are dropped anyway).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from node.learn.groups import Group
from node.learn.screen import ScreenConfig, answer_span, foreign_ngrams

MAX_PUBLISHERS = 4096  # publishers whose phrases are remembered (least recently seen out first)
MAX_PHRASES = 256  # phrases remembered per publisher (the most frequent kept)


@dataclass
class ForeignText:
    """Which publishers keep putting the same text around their right answers."""

    prefix: str  # the mix's forced answer prefix ("" on a long-form mix: no evidence is taken)
    cfg: ScreenConfig = field(default_factory=lambda: ScreenConfig("on"))
    recur: int = 3  # groups of one publisher a phrase must come in
    phrases: OrderedDict[bytes, Counter] = field(default_factory=OrderedDict)
    flagged: set[int] = field(default_factory=set)  # ids of the current batch's groups judged foreign_text

    def new_batch(self) -> None:
        self.flagged = set()

    def judge(self, publisher: bytes, group: Group) -> bool:
        """Whether `group` is foreign_text (remembered in `flagged` for the batch's bandit verdict)."""
        if not (self.prefix and self.cfg.spans) or not group.rewards:
            return False
        mean = sum(group.rewards) / len(group.rewards)
        grams: set[str] = set()
        for response, reward in zip(group.responses, group.rewards):
            if reward <= mean:
                continue
            body = response[len(self.prefix) :] if response.startswith(self.prefix) else response
            span = answer_span(self.prefix + body, group.task, self.prefix)
            if span.outside_chars > self.cfg.max_outside_chars:
                grams |= foreign_ngrams(span.outside)
        if not grams:
            return False
        seen = self.phrases.setdefault(publisher, Counter())
        self.phrases.move_to_end(publisher)
        recurring = any(seen[g] + 1 >= self.recur for g in grams)
        seen.update(grams)
        if len(seen) > MAX_PHRASES:
            self.phrases[publisher] = Counter(dict(seen.most_common(MAX_PHRASES)))
        while len(self.phrases) > MAX_PUBLISHERS:
            self.phrases.popitem(last=False)
        if recurring:
            self.flagged.add(id(group))
        return recurring

    def useful(self, groups: list[Group]) -> bool:
        """A batch counts as useful when a group with signal is not foreign_text."""
        return any(g.signal() and id(g) not in self.flagged for g in groups)
