//! A desktop chat window on kvdecode. eframe/egui draws with wgpu, and the engine decodes on the
//! very device the window draws on (`Gpu::from_device`): one device, one memory budget. Each frame
//! polls the step in flight (`kvdecode::Pending`) and starts the next, so the window keeps drawing
//! while the model decodes, streams the answer as it is sampled, and stops it on a click.
//!
//! ```text
//! desktop-chat [--model FILE.gguf|HF-DIR] [--lora ADAPTER] [--prompt TEXT] [sampling options]
//! ```
//!
//! Without `--model` it runs the embedded demo model. For tests: `--prompt` asks at start,
//! `--exit-after N` closes the window once N tokens of the first answer are shown (or it ended),
//! after a `--screenshot` and a JSON report on stdout (the answer, its ids, frames and steps).

mod chat;

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};

use clap::Parser;
use eframe::egui;
use kvdecode::{wgpu, Gpu, GpuOptions, Sampler};

use chat::{Chat, ChatOptions, Loaded};

#[derive(Parser, Debug)]
#[command(about = "A desktop chat window that decodes with kvdecode on the window's own GPU device")]
struct Args {
    /// A GGUF file, a Hugging Face directory or a kvdecode safetensors file; none: the embedded
    /// demo model.
    #[arg(long)]
    model: Option<String>,
    /// A LoRA adapter to answer with: a PEFT folder or a GGUF LoRA file.
    #[arg(long)]
    lora: Option<String>,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    /// Keep the K most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    top_k: u32,
    /// Nucleus sampling threshold in (0, 1].
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u32,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Dispatches per GPU submission: a decode step goes in parts, one per frame, so the window's
    /// own drawing waits for one part, not a whole step (0: a step at once). On lavapipe with
    /// SmolLM2, 128 gives 4 frames a step at 6.4 tokens/s (0: 1 frame, 8.6 tokens/s).
    #[arg(long, default_value_t = 128)]
    dispatches_per_submit: usize,
    /// Ask this as soon as the model is loaded.
    #[arg(long)]
    prompt: Option<String>,
    /// Close once N tokens of the first answer were shown or it ended, printing a JSON report.
    #[arg(long)]
    exit_after: Option<usize>,
    /// With --exit-after: save the window as this PNG before closing.
    #[arg(long)]
    screenshot: Option<PathBuf>,
}

fn main() -> eframe::Result {
    let args = Args::parse();
    let options = eframe::NativeOptions {
        viewport: egui::ViewportBuilder::default().with_inner_size([720.0, 520.0]).with_title("kvdecode chat"),
        renderer: eframe::Renderer::Wgpu,
        wgpu_options: egui_wgpu_setup(),
        ..Default::default()
    };
    eframe::run_native("kvdecode chat", options, Box::new(|cc| Ok(Box::new(App::new(cc, args)))))
}

/// eframe's device, requested with what kvdecode asks of the adapter (subgroups where they have
/// one size, the WebGPU limits) and what egui's drawing needs (big textures for 4K screens).
fn egui_wgpu_setup() -> eframe::egui_wgpu::WgpuConfiguration {
    use eframe::egui_wgpu::{WgpuConfiguration, WgpuSetup, WgpuSetupCreateNew};
    let mut create = WgpuSetupCreateNew::without_display_handle();
    create.device_descriptor = Arc::new(|adapter: &wgpu::Adapter| {
        let (required_features, limits) = Gpu::device_requirements(adapter, &GpuOptions::default());
        wgpu::DeviceDescriptor {
            label: Some("kvdecode chat: egui and the engine"),
            required_features,
            required_limits: wgpu::Limits { max_texture_dimension_2d: 8192, ..limits },
            ..Default::default()
        }
    });
    WgpuConfiguration { wgpu_setup: WgpuSetup::CreateNew(create), ..Default::default() }
}

/// The decoding options `kvdecode chat` takes, from the same flags.
fn chat_options(args: &Args) -> ChatOptions {
    ChatOptions {
        model: args.model.clone(),
        lora: args.lora.clone(),
        system: args.system.clone(),
        sampler: Sampler {
            temperature: args.temperature,
            seed: args.seed,
            top_k: args.top_k,
            top_p: args.top_p,
            ..Sampler::GREEDY
        },
        max_tokens: args.max_tokens,
        dispatches_per_submit: args.dispatches_per_submit,
    }
}

enum State {
    Loading(mpsc::Receiver<Result<Loaded, String>>),
    Ready(Box<Chat>),
    Failed(String),
}

struct App {
    gpu: Option<Gpu>,
    state: State,
    args: Args,
    model: String,
    adapter: Option<String>,
    input: String,
    error: Option<String>,
    frames: u64,
    /// `--exit-after`: the screenshot asked for, and taken (or not asked for).
    exiting: bool,
    reported: bool,
    shot: Arc<Mutex<Option<Result<(), String>>>>,
}

impl App {
    fn new(cc: &eframe::CreationContext<'_>, args: Args) -> App {
        let options = chat_options(&args);
        // the window's device, shared: kvdecode's buffers and egui's textures on one device
        let (gpu, state) = match cc
            .wgpu_render_state
            .as_ref()
            .map(|rs| Gpu::from_device(rs.adapter.get_info(), rs.device.clone(), rs.queue.clone()))
        {
            Some(Ok(gpu)) => (Some(gpu.clone()), State::Loading(chat::load_in_background(gpu, options))),
            Some(Err(e)) => (None, State::Failed(format!("the window's device cannot run kvdecode: {e}"))),
            None => (None, State::Failed("eframe gave no wgpu device".into())),
        };
        let model = args.model.clone().unwrap_or_else(|| "the embedded demo model".into());
        App {
            gpu,
            state,
            args,
            model,
            adapter: None,
            input: String::new(),
            error: None,
            frames: 0,
            exiting: false,
            reported: false,
            shot: Arc::default(),
        }
    }

    /// Frame bookkeeping before drawing: a finished load, the step in flight, `--exit-after`.
    fn advance(&mut self, ctx: &egui::Context) {
        if let State::Loading(rx) = &self.state {
            match rx.try_recv() {
                Ok(Ok(loaded)) => {
                    let gpu = self.gpu.as_ref().expect("a device while loading");
                    let (chat, model, adapter) = Chat::new(gpu, loaded, chat_options(&self.args));
                    (self.model, self.adapter) = (model, adapter);
                    self.state = State::Ready(Box::new(chat));
                    if let (State::Ready(chat), Some(p)) = (&mut self.state, self.args.prompt.clone()) {
                        self.error = chat.send(&p).err();
                    }
                }
                Ok(Err(e)) => self.state = State::Failed(e),
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => self.state = State::Failed("the loader stopped".into()),
            }
        }
        if let State::Ready(chat) = &mut self.state {
            if let Err(e) = chat.frame() {
                self.error = Some(e);
            }
            if let Some(n) = self.args.exit_after {
                if chat.busy() && chat.answer_ids.len() >= n {
                    chat.stop();
                }
                if !chat.busy() && !chat.messages().is_empty() && !self.exiting {
                    self.exiting = true;
                    self.ask_screenshot(ctx);
                }
            }
        }
        if let State::Failed(e) = &self.state {
            if self.args.exit_after.is_some() {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
        let done = self.shot.lock().map(|s| s.clone()).unwrap_or(None);
        if let (true, Some(saved)) = (self.exiting, done) {
            if let Err(e) = saved {
                eprintln!("error: screenshot: {e}");
                std::process::exit(1);
            }
            if !self.reported {
                self.reported = true;
                self.report();
            }
            ctx.send_viewport_cmd(egui::ViewportCommand::Close);
        }
    }

    /// Save the next frame as `--screenshot` (or note that none was asked for).
    fn ask_screenshot(&mut self, ctx: &egui::Context) {
        let Some(path) = self.args.screenshot.clone() else {
            *self.shot.lock().expect("screenshot lock") = Some(Ok(()));
            return;
        };
        let slot = self.shot.clone();
        let repaint = ctx.clone();
        ctx.request_screenshot(move |image| {
            *slot.lock().expect("screenshot lock") = Some(save_png(&path, &image));
            repaint.request_repaint();
        });
    }

    /// The `--exit-after` report: one JSON line on stdout.
    fn report(&self) {
        let State::Ready(chat) = &self.state else { return };
        let answer = chat.messages().last().map(|m| m.content.clone()).unwrap_or_default();
        let report = serde_json::json!({
            "model": self.model,
            "device": self.gpu.as_ref().map(Gpu::describe),
            "adapter": self.adapter,
            "answer": answer,
            "token_ids": chat.answer_ids,
            "steps": chat.steps,
            "frames_while_decoding": chat.frames_decoding,
            "frames": self.frames,
            "tokens_per_s": chat.tokens_per_s,
            "error": self.error,
        });
        println!("{report}");
    }
}

fn save_png(path: &std::path::Path, image: &egui::ColorImage) -> Result<(), String> {
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let [w, h] = image.size;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w as u32, h as u32);
    enc.set_color(png::ColorType::Rgba);
    enc.set_depth(png::BitDepth::Eight);
    let rgba: Vec<u8> = image.pixels.iter().flat_map(|c| c.to_array()).collect();
    enc.write_header().and_then(|mut wr| wr.write_image_data(&rgba)).map_err(|e| e.to_string())
}

impl eframe::App for App {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        let ctx = ui.ctx().clone();
        self.frames += 1;
        self.advance(&ctx);
        egui::Panel::top("model").show(ui, |ui| {
            ui.horizontal_wrapped(|ui| {
                ui.strong("model");
                ui.label(&self.model);
                ui.separator();
                ui.strong("adapter");
                ui.label(self.adapter.as_deref().unwrap_or("none"));
            });
            if let Some(gpu) = &self.gpu {
                ui.horizontal_wrapped(|ui| {
                    ui.strong("device");
                    ui.label(format!("{} (shared with this window)", gpu.describe()));
                    if let State::Ready(chat) = &self.state {
                        ui.separator();
                        ui.label(format!("{:.1} tokens/s", chat.tokens_per_s));
                        if let Some(b) = chat.engine_bytes() {
                            ui.separator();
                            ui.label(format!("engine {:.1} MiB", b as f64 / (1 << 20) as f64));
                        }
                    }
                });
            }
        });
        egui::Panel::bottom("input").show(ui, |ui| {
            ui.horizontal(|ui| match &mut self.state {
                State::Ready(chat) if chat.busy() => {
                    ui.spinner();
                    if ui.button("Stop").clicked() {
                        chat.stop();
                    }
                }
                State::Ready(chat) => {
                    let edit =
                        ui.add(egui::TextEdit::singleline(&mut self.input).hint_text("Message").desired_width(560.0));
                    let enter = edit.lost_focus() && ui.input(|i| i.key_pressed(egui::Key::Enter));
                    if (ui.button("Send").clicked() || enter) && !self.input.trim().is_empty() {
                        self.error = chat.send(&std::mem::take(&mut self.input)).err();
                    }
                }
                State::Loading(_) => {
                    ui.spinner();
                    ui.label("loading the model and compiling its kernels…");
                }
                State::Failed(e) => {
                    ui.colored_label(egui::Color32::RED, e.as_str());
                }
            });
            if let Some(e) = &self.error {
                ui.colored_label(egui::Color32::RED, e.as_str());
            }
        });
        egui::CentralPanel::default().show(ui, |ui| {
            egui::ScrollArea::vertical().stick_to_bottom(true).show(ui, |ui| {
                if let State::Ready(chat) = &self.state {
                    for m in chat.messages() {
                        ui.label(egui::RichText::new(&m.role).strong());
                        ui.label(&m.content);
                        ui.add_space(6.0);
                    }
                    if chat.busy() {
                        ui.label(egui::RichText::new("assistant").strong());
                        ui.label(&chat.answer);
                    }
                }
            });
        });
        // keep frames coming while loading or decoding: each one polls the step in flight
        if !matches!(self.state, State::Ready(ref c) if !c.busy()) || self.exiting {
            ctx.request_repaint();
        }
    }
}
