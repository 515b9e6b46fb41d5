"""Instruments: the device check (placement of every tensor), perf metrics (FLOPs, rates against
the machine) and the machine's measured rates."""
