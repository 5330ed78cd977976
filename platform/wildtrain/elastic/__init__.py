"""Ray Train wiring for a worker group that shrinks when nodes die and grows back.

Ray Train restarts the group at whatever size in [min_workers, max_workers] the cluster
can hold; the training loop re-plans its batch for that size. What is tuned here is how
quickly that happens: how long a group start may wait for a dead node's worker, and how
often a healthy but smaller group looks for room to grow, and which nodes a group may not
use because they failed its health check.

By process: `scaling` runs in the driver, `controller` in Ray Train's controller (acting on
the pure decisions of `restarts`), `nodes` in both and in the workers; `signals` are what
workers raise and the controller reads.
"""
