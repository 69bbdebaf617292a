//! The weight slots of a model as the forward pass reads them, generic over what fills a slot:
//! [`Stack`] (the checkpoint tensors a family stacks into it, by name and shape) when a family
//! map describes a checkpoint, a device buffer once loaded ([`ModelWeights`]).
//!
//! Slots follow the four GEMMs of [`crate::model::shapes`]: q/k/v rows stacked into one QKV
//! weight, gate and up rows into one FFN1 weight (a plain MLP's FFN1 is fc1 alone).

/// Checkpoint tensors (HF name, shape as stored) whose row-major data, concatenated, fill one
/// slot: stacking [rows, cols] tensors by rows is a concatenation of their data.
pub type Stack = Vec<(String, Vec<usize>)>;

/// A norm's weight, and its bias for a LayerNorm.
#[derive(Clone, Debug)]
pub struct Norm<T> {
    pub weight: T,
    pub bias: Option<T>,
}

/// One decoder layer.
#[derive(Clone, Debug)]
pub struct LayerTensors<T> {
    pub attn_norm: Norm<T>,
    /// [(H + 2G)·D, hidden]: q rows, then k, then v.
    pub qkv: T,
    pub qkv_bias: Option<T>,
    /// [hidden, H·D].
    pub o: T,
    pub o_bias: Option<T>,
    pub ffn_norm: Norm<T>,
    /// [2·inter, hidden] gate rows then up rows (gated), or [inter, hidden] (plain).
    pub ffn1: T,
    pub ffn1_bias: Option<T>,
    /// [hidden, inter].
    pub ffn2: T,
    pub ffn2_bias: Option<T>,
}

/// The whole model.
#[derive(Clone, Debug)]
pub struct Tensors<T> {
    /// [vocab, embed_dim].
    pub embed: T,
    /// Learned positions [rows, hidden] (OPT).
    pub positions: Option<T>,
    /// [hidden, embed_dim] and [embed_dim, hidden] when the embedding is narrower (OPT).
    pub project_in: Option<T>,
    pub project_out: Option<T>,
    pub layers: Vec<LayerTensors<T>>,
    pub final_norm: Norm<T>,
    /// [vocab, embed_dim]; None when tied to the embedding.
    pub lm_head: Option<T>,
}

/// A model's weights on a backend.
pub type ModelWeights<Buf> = Tensors<Buf>;

impl<T> Norm<T> {
    fn try_map<U>(self, f: &mut impl FnMut(T) -> crate::Result<U>) -> crate::Result<Norm<U>> {
        Ok(Norm {
            weight: f(self.weight)?,
            bias: self.bias.map(&mut *f).transpose()?,
        })
    }

    fn for_each<'a>(&'a self, f: &mut impl FnMut(&'a T)) {
        f(&self.weight);
        self.bias.iter().for_each(f);
    }
}

impl<T> LayerTensors<T> {
    fn try_map<U>(self, f: &mut impl FnMut(T) -> crate::Result<U>) -> crate::Result<LayerTensors<U>> {
        Ok(LayerTensors {
            attn_norm: self.attn_norm.try_map(f)?,
            qkv: f(self.qkv)?,
            qkv_bias: self.qkv_bias.map(&mut *f).transpose()?,
            o: f(self.o)?,
            o_bias: self.o_bias.map(&mut *f).transpose()?,
            ffn_norm: self.ffn_norm.try_map(f)?,
            ffn1: f(self.ffn1)?,
            ffn1_bias: self.ffn1_bias.map(&mut *f).transpose()?,
            ffn2: f(self.ffn2)?,
            ffn2_bias: self.ffn2_bias.map(&mut *f).transpose()?,
        })
    }

    fn for_each<'a>(&'a self, f: &mut impl FnMut(&'a T)) {
        self.attn_norm.for_each(f);
        f(&self.qkv);
        self.qkv_bias.iter().for_each(&mut *f);
        f(&self.o);
        self.o_bias.iter().for_each(&mut *f);
        self.ffn_norm.for_each(f);
        f(&self.ffn1);
        self.ffn1_bias.iter().for_each(&mut *f);
        f(&self.ffn2);
        self.ffn2_bias.iter().for_each(f);
    }
}

impl<T> Tensors<T> {
    /// The same slots, each converted by `f` (in a fixed order: embedding, positions,
    /// projections, layers, final norm, LM head); the first error stops the conversion.
    pub fn try_map<U>(self, mut f: impl FnMut(T) -> crate::Result<U>) -> crate::Result<Tensors<U>> {
        let f = &mut f;
        Ok(Tensors {
            embed: f(self.embed)?,
            positions: self.positions.map(&mut *f).transpose()?,
            project_in: self.project_in.map(&mut *f).transpose()?,
            project_out: self.project_out.map(&mut *f).transpose()?,
            layers: self
                .layers
                .into_iter()
                .map(|l| l.try_map(f))
                .collect::<crate::Result<Vec<_>>>()?,
            final_norm: self.final_norm.try_map(f)?,
            lm_head: self.lm_head.map(&mut *f).transpose()?,
        })
    }

    /// Every filled slot, in [`try_map`](Self::try_map)'s order.
    pub fn for_each<'a>(&'a self, mut f: impl FnMut(&'a T)) {
        let f = &mut f;
        f(&self.embed);
        self.positions.iter().for_each(&mut *f);
        self.project_in.iter().for_each(&mut *f);
        self.project_out.iter().for_each(&mut *f);
        for l in &self.layers {
            l.for_each(f);
        }
        self.final_norm.for_each(f);
        self.lm_head.iter().for_each(f);
    }

    /// The LM head: its own weight, or the embedding it is tied to.
    pub fn lm_head(&self) -> &T {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

impl Tensors<Stack> {
    /// Every checkpoint tensor named, in order.
    pub fn names(&self) -> Vec<(String, Vec<usize>)> {
        let mut v = Vec::new();
        self.for_each(|s| v.extend(s.iter().cloned()));
        v
    }

    /// Elements of every slot.
    pub fn elems(&self) -> usize {
        let mut n = 0;
        self.for_each(|s| n += stack_elems(s));
        n
    }
}

/// Elements of a stack.
pub fn stack_elems(s: &Stack) -> usize {
    s.iter().map(|(_, shape)| shape.iter().product::<usize>()).sum()
}
