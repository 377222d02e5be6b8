"""The longest duration kvpark takes anywhere: a timeout, a lease, a wait.

One week. A longer value is a unit mistake (milliseconds given as seconds), not a plan, and far
longer ones break what they are handed to: gRPC deadlines, event-loop timers and thread waits
overflow or end at once. The producer's configuration and the clients' timeouts check against
this one bound.
"""

from __future__ import annotations

MAX_SECONDS = 7 * 24 * 3600
