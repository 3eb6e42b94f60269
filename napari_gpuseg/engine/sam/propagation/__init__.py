"""Objects carried through a stack (Z or T) slice by slice with a SAM engine."""
