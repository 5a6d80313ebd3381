// The model's voice through a small jitter buffer. Playback starts once `prebuffer` samples are queued; when the
// queue runs dry it plays silence, counts an underrun and waits for the prebuffer again. A queue grown past
// `maxBuffer` (the network delivered a burst after a stall) is trimmed so the delay does not keep growing.
// `{reset: true}` drops what is queued (the user cut the speaker off). Reports, ~10 a second: level, buffered,
// underruns, and played (samples of the model's audio played so far).
class PlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions || {};
    this.prebuffer = o.prebuffer || 3840;
    this.maxBuffer = o.maxBuffer || 24000;
    this.ring = new Float32Array(1 << 18);
    this.read = 0;
    this.write = 0;
    this.playing = false;
    this.underruns = 0;
    this.played = 0;
    this.sumSquares = 0;
    this.counted = 0;
    this.port.onmessage = (e) => {
      if (e.data.reset) { this.read = this.write = 0; this.playing = false; return; }
      if (e.data.prebuffer !== undefined) { this.prebuffer = e.data.prebuffer; return; }
      this.push(e.data);
    };
  }

  get buffered() { return this.write - this.read; }

  push(samples) {
    const mask = this.ring.length - 1;
    for (let i = 0; i < samples.length; i++) this.ring[(this.write + i) & mask] = samples[i];
    this.write += samples.length;
    if (this.buffered > this.maxBuffer) this.read = this.write - this.prebuffer;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    const mask = this.ring.length - 1;
    if (!this.playing && this.buffered >= this.prebuffer) this.playing = true;
    for (let i = 0; i < out.length; i++) {
      if (this.playing && this.buffered > 0) {
        const v = this.ring[this.read & mask];
        this.read++;
        this.played++;
        out[i] = v;
        this.sumSquares += v * v;
      } else {
        if (this.playing) { this.playing = false; this.underruns++; }
        out[i] = 0;
      }
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    this.counted += out.length;
    if (this.counted >= 2400) {  // ~100 ms
      this.port.postMessage({ level: Math.sqrt(this.sumSquares / this.counted), buffered: this.buffered,
                              underruns: this.underruns, played: this.played });
      this.sumSquares = 0;
      this.counted = 0;
    }
    return true;
  }
}

registerProcessor("player-processor", PlayerProcessor);
