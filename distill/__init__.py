"""Draft distillation: prompt set, target-generated data, training, evaluation."""
