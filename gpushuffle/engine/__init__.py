"""The shuffle engine: spec (``spec``), worker-side run (``run``), received-shard
store (``store``), host buffer pool (``pool``) and the task functions (``tasks``)."""
