"""Tuning a SAM decoder on labelled images with simulated prompts (fine-tuning, few-object
adaptation) and measuring a model the same way (clicks, corrections, a box)."""
