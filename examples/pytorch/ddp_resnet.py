#!/usr/bin/env python3
"""ResNet-18 on CIFAR-10-shaped data as a Converge worker: ddp_mnist.py's worker (the kit's
contract, planned batch, gradient statistics, AdaScale learning rate, elastic data order,
fenced checkpoints, SIGTERM) with a convolutional network.

The data are generated, not downloaded, so the example runs offline: 32x32 RGB images in
10 classes, each class a smooth random colour pattern (a 4x4 grid upsampled) shifted by up
to 4 pixels, scaled by a random contrast and buried in Gaussian noise. The same --data-seed
gives the same images on every rank and host. ResNet-18 as He et al. (2016) adapt it to
32x32 inputs (a 3x3 stem, no max-pool; stages of 2 basic blocks at width w, 2w, 4w, 8w;
--width 64 is the standard network, 11.2 M parameters).

Options are ddp_mnist.py's plus --width, --train-size, --test-size, --noise, --data-seed;
--data-dir is ignored.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import ddp_mnist


def synthetic_cifar(args):
    """(train x, train y, held-out x, held-out y): float images (N, 3, 32, 32) and labels."""
    g = torch.Generator().manual_seed(args.data_seed)
    templates = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=(40, 40),
                              mode="bilinear", align_corners=False)

    def draw(count):
        y = torch.randint(0, 10, (count,), generator=g)
        dx = torch.randint(0, 9, (count,), generator=g)
        dy = torch.randint(0, 9, (count,), generator=g)
        contrast = 0.5 + torch.rand(count, 1, 1, 1, generator=g)
        x = torch.stack([templates[c, :, i:i + 32, j:j + 32]
                         for c, i, j in zip(y.tolist(), dy.tolist(), dx.tolist())])
        x = contrast * x + args.noise * torch.randn(count, 3, 32, 32, generator=g)
        return x, y

    x, y = draw(args.train_size)
    xt, yt = draw(args.test_size)
    return x, y, xt, yt


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet18(width=64, classes=10):
    layers = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, stride in enumerate((1, 2, 2, 2)):
        cout = width * 2 ** i
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def main(argv=None):
    p = ddp_mnist.parser(__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=64, help="channels of the first stage (64: ResNet-18)")
    p.add_argument("--train-size", type=int, default=10000)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--noise", type=float, default=3.0, help="standard deviation of the pixel noise")
    p.add_argument("--data-seed", type=int, default=7)
    args = ddp_mnist.parse_args(p, argv)
    if args.width < 1 or args.train_size < 1 or args.test_size < 1 or not args.noise >= 0:
        p.error("--width, --train-size and --test-size must be at least 1, --noise >= 0")
    return ddp_mnist.run(args, synthetic_cifar, lambda: resnet18(args.width), "ddp_resnet")


if __name__ == "__main__":
    sys.exit(main())
