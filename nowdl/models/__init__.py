"""Model zoo: ResNet v1/v2, AmoebaNet-D, UNet (2D/3D), plain PyTorch."""
