"""The training side: the trainer and its configuration, retraining schedules, a phase's spec, replica sharding."""
