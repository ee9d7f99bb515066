"""How many times the slow suite repeats its randomised drills (hang, straggler, culprit).

The repeats hunt flakiness: each is a full multi-process run (~60-80 s on 2 cores), and 10 of
each made the slow suite take over an hour. `DEPTHSCALE_DRILL_REPEATS` sets the count (default
10, as before): a CI that runs the slow suite can take 1, `scripts/stress_suite.sh` more. Where
the default suite runs the very same drill, that run is the first: the slow suite adds the rest
(none at 1, and no case rather than a skipped one)."""

import os

DRILL_REPEATS = max(1, int(os.environ.get("DEPTHSCALE_DRILL_REPEATS", "10")))
