"""The leaves: settings, loading MPI, package paths, progress counting, exit handling."""
