// Microphone → 80 ms frames. Runs in the AudioContext at 24 kHz, so the browser has already resampled the mic.
// Posts {frame: Float32Array(1920), level} per frame; level is the frame's RMS, for the input meter.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.frameSize = (options.processorOptions && options.processorOptions.frameSize) || 1920;
    this.buffer = new Float32Array(this.frameSize);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    let offset = 0;
    while (offset < channel.length) {
      const n = Math.min(channel.length - offset, this.frameSize - this.filled);
      this.buffer.set(channel.subarray(offset, offset + n), this.filled);
      this.filled += n;
      offset += n;
      if (this.filled === this.frameSize) {
        let sum = 0;
        for (let i = 0; i < this.frameSize; i++) sum += this.buffer[i] * this.buffer[i];
        const frame = this.buffer;
        this.port.postMessage({ frame, level: Math.sqrt(sum / this.frameSize) }, [frame.buffer]);
        this.buffer = new Float32Array(this.frameSize);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
