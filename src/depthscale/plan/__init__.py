"""`depthscale plan`: predict memory, communication, bubble, step time and MFU of a layout, and
search every layout for the fastest that fits. Pure Python: no torch, no processes."""
