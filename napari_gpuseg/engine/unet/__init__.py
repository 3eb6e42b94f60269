"""The U-Net: tiled prediction, instance labels, training."""
