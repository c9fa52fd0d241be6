"""Engine: requests, sequences, the scheduler and the block manager."""
