"""The MPI world (start-up, communicators, ranks), the launcher guard and the stall inspector."""
