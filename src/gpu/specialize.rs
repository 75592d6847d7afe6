//! A pipeline's module specialized to its `override` constants before the driver sees it
//! (natively; the browser takes WGSL and its overrides as they are).
//!
//! Why: Mesa (lavapipe, and llvmpipe behind GL) inlines every call of an entry point before it
//! folds constants, so a product pipeline for f32 weights compiled every block format's decoder
//! at every call site, then threw them away: 0.3 to 0.4 s of Mesa's front end per pipeline, most
//! of the test suite's time on lavapipe. Here naga folds the constants (the same
//! `process_overrides` wgpu runs on every pipeline), the branches they decide are cut, and the
//! functions only those branches called are dropped. The code that runs is the code that ran
//! before, statement for statement, so its results are too.

use naga::{Arena, Block, Expression, Handle, Literal, Module, Statement};

/// A kernel's WGSL module, parsed and validated once.
pub(crate) struct Parsed {
    module: Module,
    info: naga::valid::ModuleInfo,
}

impl Parsed {
    /// Parse and validate `source`; the error is naga's report.
    pub(crate) fn new(source: &str) -> Result<Parsed, String> {
        let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
            .validate(&module)
            .map_err(|e| e.emit_to_string(source))?;
        Ok(Parsed { module, info })
    }

    /// The module of compute entry point `entry` alone, `constants` in place of its overrides,
    /// every `if` they decide replaced by the branch taken, and what nothing calls any more
    /// removed.
    pub(crate) fn specialize(&self, entry: &str, constants: &[(&str, f64)]) -> Result<Module, String> {
        let values: naga::back::PipelineConstants = constants.iter().map(|(n, v)| (n.to_string(), *v)).collect();
        let (module, _) = naga::back::pipeline_constants::process_overrides(
            &self.module,
            &self.info,
            Some((naga::ShaderStage::Compute, entry)),
            &values,
        )
        .map_err(|e| e.to_string())?;
        let mut module = module.into_owned();
        let Module { functions, entry_points, constants, global_expressions, .. } = &mut module;
        let constant = |c: Handle<naga::Constant>| match global_expressions[constants[c].init] {
            Expression::Literal(Literal::Bool(b)) => Some(b),
            _ => None,
        };
        for f in functions.iter_mut().map(|(_, f)| f).chain(entry_points.iter_mut().map(|e| &mut e.function)) {
            cut(&mut f.body, &|h| decided(&f.expressions, &constant, h));
            // `let` names keep their expressions from compaction, and a cut call's named result
            // would then be an expression no statement makes: names are only for reading
            f.named_expressions.clear();
        }
        naga::compact::compact(&mut module, naga::compact::KeepUnused::No);
        Ok(module)
    }
}

/// The value of boolean expression `h` where the constants decide it: a constant, `!` of one, or
/// `&&` / `||` with a side that decides alone (`false && x`: the other side is a plain expression
/// without effects, so not evaluating it changes nothing).
fn decided(
    exprs: &Arena<Expression>,
    constant: &dyn Fn(Handle<naga::Constant>) -> Option<bool>,
    h: Handle<Expression>,
) -> Option<bool> {
    use naga::{BinaryOperator as B, UnaryOperator as U};
    let of = |h| decided(exprs, constant, h);
    match &exprs[h] {
        Expression::Literal(Literal::Bool(b)) => Some(*b),
        Expression::Constant(c) => constant(*c),
        Expression::Unary { op: U::LogicalNot, expr } => of(*expr).map(|b| !b),
        Expression::Binary { op: B::LogicalAnd, left, right } => match (of(*left), of(*right)) {
            (Some(false), _) | (_, Some(false)) => Some(false),
            (Some(true), Some(true)) => Some(true),
            _ => None,
        },
        Expression::Binary { op: B::LogicalOr, left, right } => match (of(*left), of(*right)) {
            (Some(true), _) | (_, Some(true)) => Some(true),
            (Some(false), Some(false)) => Some(false),
            _ => None,
        },
        _ => None,
    }
}

/// Replace each `if` of `block` (and of the blocks inside it) whose condition `decided` knows by
/// the branch it takes, as a block of its own.
fn cut(block: &mut Block, decided: &dyn Fn(Handle<Expression>) -> Option<bool>) {
    let old = std::mem::take(block);
    for (statement, span) in old.span_into_iter() {
        let statement = match statement {
            Statement::If { condition, mut accept, mut reject } => match decided(condition) {
                Some(taken) => {
                    let mut branch = if taken { accept } else { reject };
                    cut(&mut branch, decided);
                    Statement::Block(branch)
                }
                None => {
                    cut(&mut accept, decided);
                    cut(&mut reject, decided);
                    Statement::If { condition, accept, reject }
                }
            },
            Statement::Block(mut inner) => {
                cut(&mut inner, decided);
                Statement::Block(inner)
            }
            Statement::Loop { mut body, mut continuing, break_if } => {
                cut(&mut body, decided);
                cut(&mut continuing, decided);
                Statement::Loop { body, continuing, break_if }
            }
            Statement::Switch { selector, mut cases } => {
                for case in &mut cases {
                    cut(&mut case.body, decided);
                }
                Statement::Switch { selector, cases }
            }
            other => other,
        };
        let done = exits(&statement);
        block.push(statement, span);
        if done {
            // what followed a branch that returned is dead too (`if !W_BLOCK32 { return ..; }`)
            break;
        }
    }
}

/// Whether `statement` always leaves its block (a return, a break, ...).
fn exits(statement: &Statement) -> bool {
    match statement {
        Statement::Return { .. } | Statement::Kill | Statement::Break | Statement::Continue => true,
        Statement::Block(inner) => inner.iter().last().is_some_and(exits),
        _ => false,
    }
}
