"""The environment of an in-process GPU worker (`train.in_process`), set by the driver
(`scaling.worker_env`). Imports nothing: the controller, which imports the driver's side, need
not import the engine and torch._dynamo that `in_process` does, and the GPU drills, run where
Ray is not installed, need not import Ray."""

# What an in-process GPU worker's environment sets before Ray Train forms its group (Ray
# sets 1 only where it is unset). The first: an NCCL error or timeout aborts the
# communicators and fails the collectives, where 1 (and torch's default, 3) end the process.
# The other two keep torch's flight-recorder dump, made for runs that end at their first
# NCCL error, from stopping or ending a survivor (torch 2.11's ProcessGroupNCCL.cpp). After
# an error a group's watchdog pauses for 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (60 s by
# default), and the re-form, which destroys the group and so joins its watchdog, waited
# behind it (seen on the H200). And the error sets a process-wide "dump" flag that nothing
# clears: every later default group's heartbeat monitor would dump, and then end the process
# TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes) after the re-form (read in the source;
# tests/gpu/test_in_process_nccl.py's survivors step again after that, shortened).
SURVIVOR_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "50",
}
