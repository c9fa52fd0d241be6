"""Model definitions: forward(input_ids, positions) only; the runner handles everything else."""
