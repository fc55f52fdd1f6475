"""The runtime levers that fit a model into memory and speed it up: block swap and activation offload, FSDP,
compiled blocks, and the guards that keep them sound."""
