"""Masks without a user's prompts: segment-everything (grid points) and boxes -> masks
(a detector's or given boxes, per plane of a stack)."""
