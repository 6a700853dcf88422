"""Ready-made workflows: a real model, its data and its preprocessing (:mod:`relprop.workflows.imagenet`)."""
