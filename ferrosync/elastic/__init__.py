"""Elastic jobs: members join and leave a running job; membership is agreed through
the store alone, without a coordinator (docs/elastic.md).

``ferrosync.connect(url, elastic=True, min_ranks=1, max_ranks=None, ...)`` returns an
``ElasticSync``. Its collectives keep ``GradSync``'s contract among the members of
each round: every member calls the same collectives in the same order with the
same layouts. Each collective is one *round* r:

1. every member of the current roster (r-1) writes its contribution ``r{r}.{id}``;
2. the roster of r is agreed (``rounds.py``): who contributed in time, minus the
   members found gone, plus joiners admitted for the next round;
3. every member reads the contributions of the roster's contributors, in roster
   order, and reduces locally with the same code on the same bytes, so the result
   is bit-identical on every member (and, with the native wire, equal to the
   fixed-size backend's with ranks in that order); from ``TREE_FROM`` (5) members an
   average goes through a tree reduce instead (``tree.py``).

With ``wire_dtype`` (an average's contributions only; broadcasts and gathers are
exact copies) each member encodes its contribution with the storage transport's
``Encoder``, int8 error feedback kept per member (a member's residual is its own,
whoever else is in the round). Every member decodes every contribution, its own
included, so each is counted alike, and the average of the decoded values is not
encoded again (nothing carries it), so it is still the same bits on every member,
a newcomer included. The job's record says which ``wire_dtype`` the job uses; a
member with another is refused before it writes anything. With ``"topk"`` every average
is a flat round, at any size: the tree's partial sums would be dense (docs/topk.md).

``rank`` and ``world_size`` are this member's index in, and the size of, the latest
roster, so they may change after any collective; ``membership`` lists the member
ids and ``membership_changes`` counts the rounds in which the list changed, so a
sampler can re-shard when it moves.

A member left out of a roster although it contributed (it was too slow: its
heartbeat went silent for ``heartbeat_timeout``) raises ``PeerFailed`` saying it
was dropped; it may ``connect`` again to rejoin as a new member.

The package, one job per module: ``sync.py`` (``ElasticSync``: connecting, the
membership, the collectives, state), ``job.py`` (the job record and admission),
``exchange.py`` (one member's side of a round: its contribution, the agreement,
verified reads), ``rounds.py`` (agreeing on a roster), ``membership.py`` (heartbeats,
liveness, rosters, the join queue), ``plan.py`` and ``tree.py`` (the tree reduce's plan
and one tree round), ``state.py`` (state for newcomers). Every object and record goes
through the storage transport's object layer (``storage/objects.py``).
"""

from __future__ import annotations

from ferrosync.elastic.options import ElasticOptions
from ferrosync.elastic.state import PublishedState
from ferrosync.elastic.sync import ElasticSync, peek_state

__all__ = ["ElasticSync", "ElasticOptions", "PublishedState", "peek_state"]
