"""The MONAI networks nowdl is checked against (not a test module): one list shared by
tests/test_monai_coverage.py and docs/models.md.

Each :class:`Net` gives a ``monai.networks.nets`` class name, small-width keyword arguments as
JSON-able values (the same text goes to ``nowdl plan --model-args``), one micro-batch's input
shape, the output kind (``"image"``: an (N, C, *spatial) map for an MSE loss; ``"classes"``: logits
for a cross-entropy loss) and the norm layers it contains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Net", "NETS", "LEFT_OUT", "by_id", "build"]


@dataclass(frozen=True)
class Net:
    """One MONAI network at a small width."""

    id: str  # test id (unique)
    cls: str  # name in monai.networks.nets
    kwargs: dict[str, Any]  # JSON-able constructor arguments
    shape: tuple[int, ...]  # one micro-batch's input shape
    output: str  # "image" (segmentation / reconstruction map) or "classes" (logits)
    norms: tuple[str, ...]  # norm layers it contains: "batch", "instance", "group", "layer"
    notes: str = ""
    # why training draws random numbers (masks differ from one process's, as with Dropout): such a
    # net cannot be compared with a single-process run
    random_in_training: str = ""
    # why the net cannot run in float64 (the exact-training check runs in float64): not trained
    no_float64: str = ""

    @property
    def dims(self) -> int:
        return len(self.shape) - 2

    def model_args(self) -> str:
        """The ``--model-args`` JSON text."""
        return json.dumps(self.kwargs)

    def input_arg(self) -> str:
        """The ``--input`` text, e.g. ``1x1x32x32``."""
        return "x".join(str(s) for s in self.shape)


def _seg(sd: int) -> dict[str, Any]:
    return {"spatial_dims": sd, "in_channels": 1, "out_channels": 2}


_DROP_CONNECT = "stochastic depth: EfficientNet blocks drop samples at random in training (rate 0.2, fixed)"

NETS: list[Net] = [
    # ---- segmentation nets with long skips -------------------------------------------------------
    Net("UNet2d", "UNet", {**_seg(2), "channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1, "bias": False},
        (1, 1, 32, 32), "image", ("instance",)),
    Net("UNet3d", "UNet", {**_seg(3), "channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1, "bias": False},
        (1, 1, 16, 16, 16), "image", ("instance",)),
    Net("BasicUNet2d", "BasicUNet", {**_seg(2), "features": [4, 4, 8, 8, 16, 4], "bias": False}, (1, 1, 32, 32), "image",
        ("instance",)),
    Net("BasicUNetPlusPlus2d", "BasicUNetPlusPlus", {**_seg(2), "features": [4, 4, 8, 8, 16, 4]}, (1, 1, 32, 32),
        "image", ("instance",)),
    Net("DynUNet2d", "DynUNet", {**_seg(2), "kernel_size": [3, 3, 3], "strides": [1, 2, 2],
                                 "upsample_kernel_size": [2, 2], "filters": [4, 8, 16]},
        (1, 1, 32, 32), "image", ("instance",)),
    Net("AttentionUnet2d", "AttentionUnet", {**_seg(2), "channels": [4, 8, 16], "strides": [2, 2]},
        (1, 1, 32, 32), "image", ("batch", "instance"), "attention gates"),
    Net("SegResNet3d", "SegResNet", {**_seg(3), "init_filters": 4, "blocks_down": [1, 1, 1], "blocks_up": [1, 1],
                                     "norm": ["group", {"num_groups": 2}]},
        (1, 1, 16, 16, 16), "image", ("group",)),
    Net("SegResNetDS3d", "SegResNetDS", {**_seg(3), "init_filters": 4, "blocks_down": [1, 1, 1]},
        (1, 1, 16, 16, 16), "image", ("batch",)),
    Net("VNet3d", "VNet", {"spatial_dims": 3, "in_channels": 1, "out_channels": 2, "dropout_prob": 0.0,
                           "dropout_prob_down": 0.0, "dropout_prob_up": [0.0, 0.0]},
        (1, 1, 32, 32, 32), "image", ("batch",), "fixed widths 16-256"),
    Net("MedNeXt2d", "MedNeXt", {"spatial_dims": 2, "init_filters": 4, "in_channels": 1, "out_channels": 2,
                                 "kernel_size": 3, "blocks_down": [1, 1], "blocks_bottleneck": 1, "blocks_up": [1, 1]},
        (1, 1, 32, 32), "image", ("group",)),
    Net("FlexibleUNet2d", "FlexibleUNet", {"in_channels": 1, "out_channels": 2, "backbone": "efficientnet-b0",
                                           "decoder_channels": [16, 8, 8, 4, 4], "spatial_dims": 2},
        (1, 1, 64, 64), "image", ("batch",), "EfficientNet-B0 encoder", _DROP_CONNECT),
    Net("Quicknat2d", "Quicknat", {"num_classes": 2, "num_channels": 1, "num_filters": 4, "kernel_size": 3},
        (1, 1, 32, 32), "image", ("instance",), "max-unpooling with indices"),
    Net("HighResNet3d", "HighResNet", {"spatial_dims": 3, "in_channels": 1, "out_channels": 2, "layer_params": [
        {"name": "conv_0", "n_features": 4, "kernel_size": 3},
        {"name": "res_1", "n_features": 4, "kernels": [3, 3], "repeat": 1},
        {"name": "res_2", "n_features": 8, "kernels": [3, 3], "repeat": 1},
        {"name": "conv_1", "n_features": 8, "kernel_size": 1},
        {"name": "conv_2", "kernel_size": 1}]},
        (1, 1, 16, 16, 16), "image", ("batch",), "dilated convs"),
    Net("RegUNet3d", "RegUNet", {"spatial_dims": 3, "in_channels": 1, "num_channel_initial": 4, "depth": 2,
                                 "out_channels": 3},
        (1, 1, 16, 16, 16), "image", ("batch",)),
    Net("LocalNet3d", "LocalNet", {"spatial_dims": 3, "in_channels": 1, "num_channel_initial": 4,
                                   "extract_levels": [0, 1, 2], "out_channels": 3},
        (1, 1, 16, 16, 16), "image", ("batch",)),
    Net("VoxelMorphUNet3d", "VoxelMorphUNet", {"spatial_dims": 3, "in_channels": 2, "unet_out_channels": 4,
                                               "channels": [4, 8, 8, 8], "final_conv_channels": [4, 4]},
        (1, 2, 16, 16, 16), "image", ()),
    Net("AutoEncoder2d", "AutoEncoder", {**_seg(2), "channels": [4, 8], "strides": [2, 2]},
        (1, 1, 32, 32), "image", ("instance",)),
    Net("GlobalNet3d", "GlobalNet", {"image_size": [16, 16, 16], "spatial_dims": 3, "in_channels": 2,
                                     "num_channel_initial": 4, "depth": 2},
        (1, 2, 16, 16, 16), "image", ("batch",), "affine registration: a dense field from a regressed affine map",
        no_float64="its AffineHead keeps its grid as a float32 attribute that .double() leaves, so the model "
        "itself fails in float64 (einsum of float32 and float64)"),
    Net("SegResNetDS2_3d", "SegResNetDS2", {**_seg(3), "init_filters": 4, "blocks_down": [1, 1, 1]},
        (1, 1, 16, 16, 16), "image", ("batch",), "two decoders (segmentation and reconstruction): a tuple out"),
    # ---- transformer hybrids (only torch.export traces them) ------------------------------------
    Net("UNETR2d", "UNETR", {"in_channels": 1, "out_channels": 2, "img_size": [32, 32], "feature_size": 4,
                             "hidden_size": 32, "mlp_dim": 64, "num_heads": 2, "spatial_dims": 2},
        (1, 1, 32, 32), "image", ("instance", "layer"), "ViT encoder"),
    Net("SwinUNETR2d", "SwinUNETR", {"in_channels": 1, "out_channels": 2, "feature_size": 12,
                                     "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1], "window_size": 4,
                                     "spatial_dims": 2},
        (1, 1, 64, 64), "image", ("instance", "layer"), "Swin encoder"),
    # ---- classifiers ----------------------------------------------------------------------------
    Net("ResNet2d", "ResNet", {"block": "basic", "layers": [1, 1, 1, 1], "block_inplanes": [4, 8, 16, 32],
                               "spatial_dims": 2, "n_input_channels": 1, "num_classes": 3,
                               "bias_downsample": False},
        (1, 1, 32, 32), "classes", ("batch",)),
    Net("ResNet3d", "ResNet", {"block": "basic", "layers": [1, 1, 1, 1], "block_inplanes": [4, 8, 16, 32],
                               "spatial_dims": 3, "n_input_channels": 1, "num_classes": 3,
                               "bias_downsample": False},
        (1, 1, 32, 32, 32), "classes", ("batch",)),
    Net("DenseNet2d", "DenseNet", {"spatial_dims": 2, "in_channels": 1, "out_channels": 3, "init_features": 4,
                                   "growth_rate": 4, "block_config": [2, 2], "bn_size": 2},
        (1, 1, 32, 32), "classes", ("batch",)),
    Net("SENet2d", "SENet", {"spatial_dims": 2, "in_channels": 1, "block": "se_resnet_bottleneck",
                             "layers": [1, 1, 1, 1], "groups": 1, "reduction": 4, "dropout_prob": None,
                             "inplanes": 8, "input_3x3": False, "downsample_kernel_size": 1, "num_classes": 3},
        (1, 1, 64, 64), "classes", ("batch",), "squeeze-and-excitation"),
    Net("EfficientNetBN2d", "EfficientNetBN", {"model_name": "efficientnet-b0", "pretrained": False,
                                               "spatial_dims": 2, "in_channels": 1, "num_classes": 3},
        (1, 1, 64, 64), "classes", ("batch",), "fixed widths (B0)", _DROP_CONNECT),
    Net("Discriminator2d", "Discriminator", {"in_shape": [1, 32, 32], "channels": [4, 8], "strides": [2, 2]},
        (1, 1, 32, 32), "classes", ("instance",)),
    Net("Regressor2d", "Regressor", {"in_shape": [1, 32, 32], "out_shape": [2], "channels": [4, 8],
                                     "strides": [2, 2]},
        (1, 1, 32, 32), "classes", ("instance",)),
    Net("Classifier2d", "Classifier", {"in_shape": [1, 32, 32], "classes": 3, "channels": [4, 8], "strides": [2, 2]},
        (1, 1, 32, 32), "classes", ("instance",)),
]

#: The other networks of monai.networks.nets (aliases such as Unet or DenseNet121 aside), and why
#: they are not in NETS (docs/models.md lists them).
LEFT_OUT: dict[str, str] = {
    "DAF3D, MILModel, TorchVisionFCModel, NetAdapter": "wrap torchvision backbones; torchvision's own FCN and "
    "DeepLabV3 are covered by tests/test_zoo_coverage.py (docs/results/zoo_models.md)",
    "SEResNet50, SEResNet101, SEResNet152, SEResNext50, SEResNext101, SENet154": "SENet at fixed ImageNet widths: "
    "the same code as SENet2d above, whose small widths keep the test quick",
    "DenseNet121, DenseNet169, DenseNet201, DenseNet264": "DenseNet at fixed depths and widths (DenseNet2d above)",
    "EfficientNet, EfficientNetBNFeatures, EfficientNetEncoder, ResNetFeatures, ResNetEncoder": "backbones behind "
    "EfficientNetBN, FlexibleUNet and ResNet above",
    "SegResNetVAE, VarAutoEncoder": "draw a random sample in forward (reparameterisation), so training cannot "
    "match one process (each rank draws its own); tried by hand (2026-11-25): SegResNetVAE 2D (init_filters 8, "
    "32x32) plans in 4 stages in 0.3 s and VarAutoEncoder 2D in 0.2 s, their stages equal to the model in eval "
    "mode",
    "AHNet, HoVerNet": "fixed widths (25M and 33M parameters at any input), too slow for this list; tried by hand "
    "(2026-11-25): both plan in 4 stages whose outputs equal the model's, AHNet 2D at 64x64 in 5.4 s (417 "
    "nodes, fx), HoVerNet at 256x256 in 21 s (441 nodes, torch.export, 11 s of it checking the exported graph "
    "by running the model at that size)",
    "VoxelMorph": "forward(moving, fixed) takes two images, which this list's one input shape cannot give; "
    "tried by hand: `nowdl plan monai.networks.nets:VoxelMorph --input 1x1x32x32x32 --input 1x1x32x32x32 "
    "--gpus 4 --stages 4` plans in 6.9 s (322 nodes, torch.export) and its stages equal the model; "
    "two-input training is tested on a net of the same shape (tests/runtime/test_training.py)",
    "Generator, Critic": "take a latent vector or score images for adversarial training (Generator tried by "
    "hand: a 16-vector in, plans in 0.1 s, stages equal the model); Discriminator and Regressor above are "
    "the same blocks",
    "ViT, ViTAutoEnc, MaskedAutoEncoderViT, NaViT, Transchex, DecoderOnlyTransformer, FullyConnectedNet, "
    "VarFullyConnectedNet": "transformers or MLPs, not CNNs (UNETR and SwinUNETR cover the transformer-CNN hybrids)",
    "DiNTS, TopologyInstance, TopologySearch": "need a searched architecture (a DiNTS search space)",
    "DiffusionModelUNet": "forward(x, timesteps) takes integer time steps beside the image, which this list's "
    "one input shape cannot give; tried by hand (2026-11-25; channels (8, 16), attention at the second level, "
    "1x1x32x32 and one time step): plans in 4 stages in 5.0 s (torch.export), its stages equal the model, and "
    "3 Adam steps on 2 pipeline ranks in float64 match one process (losses equal, weights within 3e-12); "
    "integer inputs beside the image are tested on a small net (tests/runtime/test_training.py)",
    "VISTA3D, AutoencoderKL, ControlNet, VQVAE, SPADE* nets, PatchDiscriminator, "
    "MultiScalePatchDiscriminator": "generative or promptable models with extra inputs (prompts, "
    "conditioning) or several outputs; not tried",
}


def by_id(net_id: str) -> Net:
    return next(n for n in NETS if n.id == net_id)


def build(net: Net) -> nn.Module:
    """The model, built from the same JSON text the CLI receives."""
    import monai.networks.nets as nets

    return getattr(nets, net.cls)(**json.loads(net.model_args()))  # type: ignore[no-any-return]
