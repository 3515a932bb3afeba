"""Pipeline package: stages, schedules and layer migration on torch.distributed."""
