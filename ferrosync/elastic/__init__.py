"""Elastic jobs: members join and leave a running job, agreeing on membership through the
store alone, without a coordinator (docs/elastic.md).

``connect(url, elastic=True, ...)`` returns an ``ElasticSync``: ``GradSync``'s contract
among the members of each round, one round per collective; ``rank`` and ``world_size``
are the latest roster's and may change after any collective, and a member dropped from
a roster raises ``MemberDropped`` (a ``PeerFailed``). Rounds, the tree reduce, joining
and state: docs/elastic.md#rounds and after. Every object and record goes through the
storage backend's object layer (``storage/objects.py``).
"""

from __future__ import annotations

from ferrosync.elastic.ballot import LeaveBallot
from ferrosync.elastic.events import MembershipChange
from ferrosync.elastic.options import ElasticOptions
from ferrosync.elastic.state import PublishedState
from ferrosync.elastic.sync import ElasticSync, peek_state

__all__ = ["ElasticSync", "ElasticOptions", "MembershipChange", "LeaveBallot",
           "PublishedState", "peek_state"]
