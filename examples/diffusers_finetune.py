"""Fine-tuning a diffusion UNet under a memory budget: a small Stable-Diffusion-style ``UNet2DConditionModel``
(random weights from a config, nothing downloaded) trained on the noise-prediction loss, planned in place.

    python examples/diffusers_finetune.py              # plan the UNet in place, train 5 steps, print plan and losses
    ckplan examples/diffusers_finetune.py --budget 60%  # the plan alone, from the command line

Each step noises the latents at random timesteps (``DDPMScheduler.add_noise``) and regresses the noise, as
diffusers' text-to-image training scripts do; in a real run the latents come from the VAE and the text states from
the text encoder. ``planner.enable`` plans the UNet object itself at 60% of its un-checkpointed peak: the training
loop, the optimizer and ``save_pretrained`` see the same object, and ``planner.disable`` takes the plan off.
"""

import diffusers
import torch
import torch.nn.functional as F

ROWS, LATENT, TEXT_TOKENS, TEXT_WIDTH = 4, 16, 8, 32
scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)


def build() -> diffusers.UNet2DConditionModel:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=LATENT, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_WIDTH, attention_head_dim=8, norm_num_groups=8)


def batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One step's UNet call (noised latents, timesteps, text states) and the noise it should predict."""
    g = torch.Generator().manual_seed(step)
    latents = torch.randn(ROWS, 4, LATENT, LATENT, generator=g)
    text = torch.randn(ROWS, TEXT_TOKENS, TEXT_WIDTH, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (ROWS,), generator=g)
    return {"sample": scheduler.add_noise(latents, noise, timesteps), "timestep": timesteps,
            "encoder_hidden_states": text}, noise


model = build
inputs, _target = batch(0)


def loss_fn(output) -> torch.Tensor:
    return F.mse_loss(output.sample, _target)


if __name__ == "__main__":
    import planner

    unet = build().train()
    plan = planner.enable(unet, "60%", inputs=inputs, loss_fn=loss_fn)
    print(plan.summary())
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    for step in range(5):
        call, noise = batch(step)
        loss = F.mse_loss(unet(**call).sample, noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    planner.disable(unet)
